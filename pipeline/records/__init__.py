"""What a run takes in and leaves behind, as files and stored values.

This room holds the records around a pass: :mod:`~.files` (a submission's files as bytes and
text, read through an injected reader), :mod:`~.state_refs` (a stage's state with its large
parts by reference, each stored once per pass), :mod:`~.result_bounds` (what a finished
result may hold besides its output), :mod:`~.run_scores` (a run's score as its workers' latest
results add up, and the unscored ones not counted), :mod:`~.artifacts` (the delegation
artifacts and the manager summary, written atomically) and :mod:`~.archive_file` (a run's
JSON Lines file outside Redis, signed; the archiver that writes it is ``workers.archiving``,
its Redis index ``pipeline.store.archive_index``). It builds on the foundations
(``pipeline.errors``, ``models``, ``settings``), on :mod:`pipeline.text` and
:mod:`pipeline.security`, and reads one helper from elsewhere (the critics' clipping); it must
not import the loop (but for type annotations), the LLM calls, the store or the wiring
(``tests/unit/test_rooms.py``), nor redis, celery, kombu or litellm
(``tests/unit/test_layering.py``): it does no I/O but through what it is handed, and writes
files only where a caller names the directory. Each name is imported from its module: this
package re-exports nothing.
"""
