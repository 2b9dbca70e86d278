"""The parts of the Bagua-style API; users import ``torch_groupcomm.communication``."""
