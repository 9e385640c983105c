"""HTTP around the OpenAI protocol: the Starlette app and its routes (``app``,
``utility_routes``), request bodies under limits (``bodies``), server-sent events
(``streaming``), the API key and Host checks (``guard``), connections a flood cannot
hold (``connection``), and running it on uvicorn (``uvicorn_server``) or hypercorn
(``hypercorn_server``).
"""
