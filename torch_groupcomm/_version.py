"""The release number, in one place: setup.py reads it and adds the torch a
build is compiled against as the local label (``0.1.0+torch2.13.0.cpu``);
``torch_groupcomm.__version__`` is that full version once built."""

RELEASE = "0.1.0"
