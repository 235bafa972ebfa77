"""The command lines: ``generate`` (text generation, timings and the demo), ``serve``
(the OpenAI-compatible server), ``calibrate`` / ``kascade_calibrate`` /
``prefill_profile`` (the shipped calibration data) and their shared option parser.
``python -m models.generate`` and ``python -m models.serve`` are thin entry modules
over ``generate`` and ``serve``."""
