"""``python -m cudnn_attn``: the command line (see :mod:`cudnn_attn.tools.cli`)."""

from cudnn_attn.tools.cli import main

raise SystemExit(main())
