"""The chat template's environment: the date as Llama 3.x templates ask for it (strftime_now), and the
request's template variables (chat_template_kwargs), which never replace the ones the server gives."""
from __future__ import annotations

import datetime

from fastserve.models.chat_template import ChatTemplate

# Llama 3.1's own date handling, as its template has it
LLAMA31_DATE = ('{%- if not date_string is defined %}{%- if strftime_now is defined %}'
                '{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}'
                '{%- endif %}{%- endif %}Today Date: {{ date_string }}|{{ messages[0]["content"] }}'
                '{% if enable_thinking is defined %}|think={{ enable_thinking }}{% endif %}')


def test_strftime_now_gives_todays_date_and_kwargs_are_variables():
    t = ChatTemplate(LLAMA31_DATE)
    today = datetime.datetime.now().strftime("%d %b %Y")
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render(msgs) == f"Today Date: {today}|hi"
    assert t.render(msgs, kwargs={"date_string": "01 Jan 2030", "enable_thinking": False}) == \
        "Today Date: 01 Jan 2030|hi|think=False"
    assert t.render(msgs, kwargs={"messages": [{"content": "injected"}]}).endswith("|hi")   # never replaced
