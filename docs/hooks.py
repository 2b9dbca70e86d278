"""mkdocs hook: drop the Sphinx roles (``:class:``, ``:func:``, ...) that the
docstrings use, so the API reference shows only the name in code."""

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):(?=<code>)")


def on_page_content(html, **kwargs):
    return _ROLE.sub("", html)
