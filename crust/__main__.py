from crust.cli import main

raise SystemExit(main())
