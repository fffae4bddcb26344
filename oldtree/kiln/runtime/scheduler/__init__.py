"""The continuous-batching scheduler (``scheduler.py``), its requests (``request.py``) and a step's
batch with the index lists it hands the model runner (``batch.py``)."""
