"""How crust-runc (frontend.c) starts the Python runtime: `python -I -S
entry.py ARGS`.

Without the site module the interpreter neither scans site-packages nor
loads an editable install's import hook, which is most of its start; the
runtime needs nothing but the standard library and crust itself, found
here, two directories up. It goes last on the path, so that nothing beside
crust's package can stand in for a standard module.
"""

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from crust.oci_runtime.main import main  # (after the path is set)

sys.exit(main())
