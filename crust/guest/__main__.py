"""python3 -m crust.guest: the guest agent (crust.guest.agent)."""

import sys

from crust.guest.agent import main

sys.exit(main())
