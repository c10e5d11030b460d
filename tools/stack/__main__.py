"""``python -m tools.stack``: the single stack, or with ``--brokers 3`` the cluster.

Here and not in ``tools/stack/cli.py``: ``tools.cluster`` builds on this
package, so the package cannot import it back.
"""

import sys

from tools import cluster
from tools.stack import main

sys.exit(main(cluster_cli=cluster.cli))
