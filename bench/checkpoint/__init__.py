"""The checkpoint wrapper against torch's ``checkpoint``: a train step's time and memory, the
no-grad adaptation step, compiled steps, and the wrapper's fixed cost per call."""
