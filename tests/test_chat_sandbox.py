"""The bounded jinja sandbox chat templates run in: what it renders equals jinja's own
sandbox, and what it refuses (values past their size, renders past their deadline) it
refuses before the cost is paid."""

from __future__ import annotations

import threading
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.models import chat_sandbox
from engine.models.chat_sandbox import BoundedSandbox, TemplateBudgetError, render_budget

# Templates that use everything the sandbox intercepts or rewrites, within bounds.
ORDINARY = [
    "{% for m in messages %}{{ m.role + ': ' + m.content }}\n{% endfor %}",
    "{{ 2 ** 10 }} {{ 3 * 4 }} {{ 'ab' * 3 }} {{ [1, 2] * 2 }} {{ 7 % 3 }} {{ '%5.2f|%-4d' % (3.14159, 7) }}",
    "{{ 'x' ~ 1 ~ 'y' }}{% set s = 'a' ~ 'b' %}{{ s }}",
    "{% for i in range(5) %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ m.content|upper }}{% else %}none{% endfor %}",
    "{{ 'a b'|replace(' ', '_') }} {{ ['x', 'y']|join(', ') }} {{ 'hi'|center(6) }}|{{ 'q'|indent(2, true) }}",
    "{{ '{:>4}'.format(7) }} {{ 'a-b'.replace('-', '+') }} {{ ', '.join(['1', '2']) }} {{ 'ab'.upper() }}",
    "{{ '%s and %s'|format('x', 'y') }} {{ messages|map(attribute='role')|join(',') }}",
    "{% macro line(m) %}[{{ m.role }}]{% endmacro %}{% for m in messages %}{{ line(m) }}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{{ range(3)|list }}",
]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source", ORDINARY)
def test_an_ordinary_template_renders_as_in_jinjas_own_sandbox(source: str) -> None:
    expected = ImmutableSandboxedEnvironment().from_string(source).render(messages=MESSAGES)
    template = BoundedSandbox().from_string(source)
    with render_budget(10.0):
        assert chat_sandbox.render(template, messages=MESSAGES) == expected
    assert template.render(messages=MESSAGES) == expected  # without a budget too


@pytest.mark.parametrize("source", [
    "{{ 7 ** 50000000 }}", "{{ 10 ** 100000 }}", "{{ (2 ** 60000) * (2 ** 60000) }}",
    "{{ 'x' * 10 ** 9 }}", "{{ 10 ** 9 * 'x' }}", "{{ ([1] * 100000) * 100000 }}",
    "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{{ 'a'|center(1000000000) }}", "{{ 'a'.ljust(1000000000) }}", "{{ {}|tojson(indent=10**9) }}",
    "{{ '%0999999999d' % 1 }}", "{{ '%.9999999f' % 1 }}", "{{ '%*d' % (10 ** 9, 1) }}",
    "{{ '%0999999999d'|format(1) }}", "{{ '{:>999999999}'.format(1) }}",
    "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "{% set s = 'a' * 1000000 %}{{ s|replace('a', s) }}",
    "{{ range(100000)|join('x' * 1000000) }}", "{{ ('x' * 1000000).join(range(100000)|map('string')) }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
])
def test_a_template_past_its_size_budget_is_refused_quickly(source: str) -> None:
    # The deadline is far away: each is refused for its size, before the work is done.
    t0 = time.process_time()
    with render_budget(60.0), pytest.raises(TemplateBudgetError):
        chat_sandbox.render(BoundedSandbox().from_string(source))
    assert time.process_time() - t0 < 10.0  # hang guard: none of them ran its course


def test_a_template_that_loops_for_ever_stops_at_its_deadline() -> None:
    template = BoundedSandbox().from_string(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    with render_budget(0.2), pytest.raises(TemplateBudgetError, match="longer than 0.2 s"):
        chat_sandbox.render(template)
    assert time.monotonic() - t0 < 30.0  # hang guard


def test_exponential_macro_recursion_stops_at_its_deadline() -> None:
    template = BoundedSandbox().from_string(
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}")
    with render_budget(0.2), pytest.raises(TemplateBudgetError):
        chat_sandbox.render(template)


def test_a_cancelled_budget_stops_the_render_from_another_thread() -> None:
    template = BoundedSandbox().from_string(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    budget = chat_sandbox.RenderBudget(None)
    errors: list[BaseException] = []

    def work() -> None:
        with budget.active():
            try:
                chat_sandbox.render(template)
            except TemplateBudgetError as exc:
                errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.1)
    budget.cancel()
    thread.join(30.0)
    assert not thread.is_alive() and "cancelled" in str(errors[0])


def test_a_budget_is_per_thread() -> None:
    # One thread's deadline does not stop another thread's render.
    template = BoundedSandbox().from_string("{% for i in range(3000) %}{{ i }}{% endfor %}")
    with render_budget(0.0):
        results: list[str] = []
        thread = threading.Thread(target=lambda: results.append(chat_sandbox.render(template)))
        thread.start()
        thread.join(30.0)
        assert results and results[0].endswith("2999")
        with pytest.raises(TemplateBudgetError):
            chat_sandbox.render(template)


def test_the_size_budget_grows_with_the_messages() -> None:
    big = "x" * (chat_sandbox.DEFAULT_MAX_CHARS + 10)
    template = BoundedSandbox().from_string("{{ m + '!' }}")
    with render_budget(10.0), pytest.raises(TemplateBudgetError):
        chat_sandbox.render(template, m=big)
    with render_budget(10.0, max_chars=4 * len(big)):
        assert chat_sandbox.render(template, m=big) == big + "!"


def test_a_syntax_error_is_still_jinjas() -> None:
    with pytest.raises(jinja2.TemplateSyntaxError):
        BoundedSandbox().from_string("{% for %}")
