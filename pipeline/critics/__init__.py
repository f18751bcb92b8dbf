"""Critics (one protocol, several implementations) and the revisers that pair with them.

One module each, and each name is imported from its module (this package re-exports nothing):
the protocols and the merge in :mod:`pipeline.critics.base`, the token-free critics in
:mod:`pipeline.critics.heuristic` and :mod:`pipeline.critics.rubric`, the LLM critics in
:mod:`pipeline.critics.llm` (with their prompts in :mod:`pipeline.critics.llm_prompts` and reply
parsing in :mod:`pipeline.critics.llm_reply`, and the workspace snapshot they must respect in
:mod:`pipeline.critics.grounding`), so that importing one never loads the model-calling code.
"""
