"""python3 -m crust.guest: the guest agent (crust.guest.agent).

--import-nice N: the agent's imports run at scheduling priority N, then it
serves at the one it started with. Under software emulation the imports
take a second or more of the VM's one CPU, which the rest of the boot
should have first; but for IMPORT_NICE_SECONDS at most: a guest kept busy
(a container spinning, the shell agent serving request after request)
would otherwise leave the imports a sliver of the CPU for minutes.
"""

import os
import sys
import threading

IMPORT_NICE_SECONDS = 3.0

started_at = None
if "--import-nice" in sys.argv:
    at = sys.argv.index("--import-nice")
    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[at + 1]))
    del sys.argv[at:at + 2]
    # A priority is a thread's: this one's id is the process's.
    restore = threading.Timer(IMPORT_NICE_SECONDS, os.setpriority, (os.PRIO_PROCESS, os.getpid(), started_at))
    restore.daemon = True
    restore.start()

from crust.guest.agent import main

if started_at is not None:
    restore.cancel()
    os.setpriority(os.PRIO_PROCESS, 0, started_at)
sys.exit(main())
