"""`python -m server_bridge`: the bridge service (see server_bridge/service.py)."""

import sys

from server_bridge.service import main

sys.exit(main())
