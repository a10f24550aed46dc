"""``python -m demo``: the main job (demo/run.py)."""

from demo.run import main

raise SystemExit(main())
