"""Allow ``python -m commwire`` as a synonym of the ``commwire`` command."""

import sys

from .cli import main

sys.exit(main())
