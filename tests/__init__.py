"""The unit and integration tests, one folder per package they test (tests/dra/node for dra/node/, ...); the
end-to-end tests in e2e/; what the tests share in support/ (on the import path, see pyproject.toml)."""
