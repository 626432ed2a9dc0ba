"""OpenAI's Responses API (``/v1/responses``): the request as a chat request
(:mod:`.protocol`), the answer's items and events (:mod:`.builder`), the bounded store of
past responses (:mod:`.store`)."""
