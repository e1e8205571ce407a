from doctor_fixtures import tmpfs  # noqa: F401 - the fixture, shared by the doctor tests
