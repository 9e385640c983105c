"""The hybrid-aware router in Ray Serve: ``router`` (the request router), ``replicas``
(what each replica reports) and ``engine`` (an engine replica it follows). Needs the
``ray`` extra."""
