"""``python -m examples.hf_engine``: run the example (see run.py)."""

from .run import main

raise SystemExit(main())
