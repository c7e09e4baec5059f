"""`python tools/make_tiny_model.py OUT ...`: same as `python -m vime.tools.make_tiny_model OUT ...`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing vime

from vime.tools.make_tiny_model import main  # noqa: E402

if __name__ == "__main__":
    main()
