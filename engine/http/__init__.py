"""The HTTP server: an OpenAI-compatible app (quart-trio on hypercorn) over the embedded
engine API, one package per API family; :mod:`engine.http.app` assembles them."""
