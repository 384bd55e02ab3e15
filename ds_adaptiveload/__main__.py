from ds_adaptiveload.cli import main

raise SystemExit(main())
