"""``python -m cudnn_attn``: the command line (see :mod:`cudnn_attn.cli`)."""

from cudnn_attn.cli import main

raise SystemExit(main())
