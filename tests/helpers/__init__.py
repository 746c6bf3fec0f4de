"""What the tests use but are not tests: the in-process communicator (``fakecomm``), the rules' in-process
harness (``rule_math``), the discovered rules (``rules``), scripts that mpirun starts (``comm_job``,
``ddp_reference``), and models and data sets a run names by dotted path or through ``tests/conf``
(``dies``, ``faulty``, ``nan_once``, ``plain_data``, ``tiny_lm``)."""
