"""The HTTP face: FastAPI app, OpenAI wire schemas, routes, auth, the one error envelope."""
