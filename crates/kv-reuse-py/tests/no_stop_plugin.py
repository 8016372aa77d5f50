"""A pytest plugin for test_cleanup.py: test_publisher's ``stop_process``
does nothing, so a publish that its test expects to time out against a
stopped nats-server goes through, and the test fails where it expects the
timeout."""


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ == "test_publisher":
            item.module.stop_process = lambda proc, within_s=10.0: None
