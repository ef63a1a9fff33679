import sys

from weights_convert.convert import main

sys.exit(main())
