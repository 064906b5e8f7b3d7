"""Start the mlxd server from a source checkout: `python launch.py --model PATH`.

The same as the `mlxd` command that `pip install` puts on the PATH; the launcher
itself is `mlxd/launcher.py`.
"""

import sys

from mlxd.launcher import main

if __name__ == "__main__":
    sys.exit(main())
