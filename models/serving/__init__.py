"""Serving: the continuous-batching engine over a loaded model (requests, scheduler,
slot back-ends, the loop), data-parallel replicas of it, and the OpenAI-compatible
HTTP app (:mod:`models.serving.server`; its command line is :mod:`models.cli.serve`)."""
