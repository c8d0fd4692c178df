"""python3 -m crust.guest: the guest agent (crust.guest.agent)."""

import sys

from crust.guest.deferred import defer_unused

defer_unused()

from crust.guest.agent import main  # noqa: E402 - after the deferral, which its imports meet

sys.exit(main())
