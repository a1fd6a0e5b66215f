from recursive_lightning.cli import main

raise SystemExit(main())
