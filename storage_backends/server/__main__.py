"""`python -m storage_backends.server` = `hicache-server`."""

from storage_backends.server.server import main

raise SystemExit(main())
