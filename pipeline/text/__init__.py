"""Text as a reader sees it: normalisation, fingerprints, escaping and Markdown reading.

This room holds pure functions over strings: :mod:`pipeline.text.textnorm` (the text a scan
must see behind escapes, zero-width and look-alike characters), :mod:`pipeline.text.simhash`
(64-bit fingerprints and the near-duplicate index), :mod:`pipeline.text.escaping` (worker-made
text made inert on a terminal and in Markdown) and :mod:`pipeline.text.paper_markdown` (a
Markdown paper draft read into the rubric critic's shape); the compiled scanner
``pipeline.text._fastscan`` accelerates the Layer-0 scan and simhash. Nothing here imports another
room of ``pipeline`` (text is the bottom floor: the contract, the security scans and the
critics build on it), nor redis, celery, kombu or litellm (``tests/unit/test_layering.py``).
Each name is imported from its module: this package re-exports nothing.
"""
