from runtime.restart import GiveUp, Restart, RestartPolicy


def test_backoff_doubles_per_crash_in_window_and_is_capped() -> None:
    policy = RestartPolicy(max_restarts=10, window_s=100, backoff_initial_s=0.5, backoff_max_s=3)
    delays = [policy.on_crash(float(t)) for t in range(5)]
    assert delays == [Restart(0.5, 1), Restart(1.0, 2), Restart(2.0, 3), Restart(3, 4), Restart(3, 5)]


def test_more_crashes_than_intensity_within_window_gives_up() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10)
    assert isinstance(policy.on_crash(0.0), Restart)
    assert isinstance(policy.on_crash(1.0), Restart)
    assert policy.on_crash(2.0) == GiveUp(3)


def test_crashes_older_than_window_are_forgotten() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=10, backoff_initial_s=1)
    policy.on_crash(0.0)
    policy.on_crash(1.0)
    # Both earlier crashes fall out of the window: this is a first crash again.
    assert policy.on_crash(11.5) == Restart(1, 1)
