"""Project documentation; `docs.generate_api` writes `docs/api.md` from the code."""
