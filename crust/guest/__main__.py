"""python3 -m crust.guest: the guest agent (crust.guest.agent).

--import-nice N: the agent's imports run at scheduling priority N, then it
serves at the one it started with. Under software emulation the imports
take a second or more of the VM's one CPU, which the rest of the boot
should have first.
"""

import os
import sys

started_at = None
if "--import-nice" in sys.argv:
    at = sys.argv.index("--import-nice")
    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[at + 1]))
    del sys.argv[at:at + 2]

from crust.guest.agent import main

if started_at is not None:
    os.setpriority(os.PRIO_PROCESS, 0, started_at)
sys.exit(main())
