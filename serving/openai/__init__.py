"""The OpenAI protocol without HTTP: a request body to a checked request, a prompt to
token ids, an engine's outputs to the answer's body.

``protocol`` (completions and chat completions) with ``fields``, ``sampling_fields``,
``structured`` and ``json_text`` (reading a body's fields), ``messages``, ``tools`` and
``chat_template`` with its ``template_sandbox`` (a chat to a prompt), ``prompts`` (a
prompt to token ids), ``admission`` and ``grammar_check`` (checks before a request is
queued), ``service`` (one generation request against the engine), ``choices``, ``text``
and ``logprobs`` (outputs to choices), ``response_bodies`` (the answer's JSON),
``responses_api`` (the Responses API as a chat request) and ``errors`` (the API's
errors). Nothing here imports HTTP: ``serving/http/`` sits on top.
"""
