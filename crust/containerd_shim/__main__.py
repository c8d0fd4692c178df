import sys

from crust.containerd_shim.main import main

sys.exit(main())
