from engine_svc.server.main import main

raise SystemExit(main())
