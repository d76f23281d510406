import sys

from moeflow.cli import main

sys.exit(main())
