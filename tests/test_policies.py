"""Restart/reschedule delays and the sliding window, as properties."""

from hypothesis import given, strategies as st

from mn_prefect.model.policies import RetryPolicy, attempts_in_window, fibonacci, retry_delay_ms

delays = st.integers(min_value=0, max_value=10**7)
caps = st.integers(min_value=0, max_value=10**8)
attempt = st.integers(min_value=1, max_value=10**4)


def test_documented_sequences():
    exp = RetryPolicy(delay_ms=1000, delay_function="exponential", max_delay_ms=30_000)
    fib = RetryPolicy(delay_ms=1000, delay_function="fibonacci", max_delay_ms=5000)
    const = RetryPolicy(delay_ms=500, delay_function="constant", max_delay_ms=500)
    assert [exp.delay_for(n) for n in range(1, 8)] == [1000, 2000, 4000, 8000, 16000, 30000, 30000]
    assert [fib.delay_for(n) for n in range(1, 8)] == [1000, 1000, 2000, 3000, 5000, 5000, 5000]
    assert [const.delay_for(n) for n in (1, 2, 50)] == [500, 500, 500]


@given(delays, caps, attempt, st.sampled_from(["constant", "exponential", "fibonacci"]))
def test_delay_never_exceeds_the_cap(delay, cap, n, function):
    policy = RetryPolicy(delay_ms=delay, max_delay_ms=cap, delay_function=function)
    value = retry_delay_ms(policy, n)
    assert 0 <= value and (cap == 0 or value <= cap)


@given(delays, attempt, st.sampled_from(["exponential", "fibonacci"]))
def test_growing_delays_never_shrink(delay, n, function):
    policy = RetryPolicy(delay_ms=delay, max_delay_ms=10**9, delay_function=function)
    assert retry_delay_ms(policy, n + 1) >= retry_delay_ms(policy, n)


@given(st.integers(min_value=1, max_value=60))
def test_exponential_and_fibonacci_formulas(n):
    assert retry_delay_ms(RetryPolicy(delay_ms=3, delay_function="exponential"), n) == 3 * 2 ** (n - 1)
    assert retry_delay_ms(RetryPolicy(delay_ms=3, delay_function="fibonacci"), n) == 3 * fibonacci(n)


@given(st.lists(st.integers(min_value=0, max_value=10**6), max_size=30), st.integers(min_value=0, max_value=10**6),
       st.integers(min_value=1, max_value=10**6))
def test_window_counts_exactly_the_attempts_inside_it(times, now, interval):
    count = attempts_in_window(times, now, interval)
    assert count == len([t for t in times if now - interval < t <= now])
    assert attempts_in_window(times, now + interval, interval) == len([t for t in times if now < t <= now + interval])


def test_attempts_slide_out_of_the_window():
    policy = RetryPolicy(attempts=2, interval_ms=1000)
    assert policy.allows([0, 100], 500) is False
    assert policy.allows([0, 100], 1001) is True  # the attempt at 0 left the window
    assert policy.remaining([0, 100], 1001) == 1
    assert RetryPolicy(unlimited=True).allows([1] * 100, 2) is True
