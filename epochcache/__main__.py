from epochcache.cli import main

raise SystemExit(main())
