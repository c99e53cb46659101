import sys

from wsllm.cli import main

sys.exit(main())
