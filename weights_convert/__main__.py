"""`python -m weights_convert SRC DST [...]`: see weights_convert/convert.py."""
import sys

from weights_convert.convert import main

sys.exit(main())
