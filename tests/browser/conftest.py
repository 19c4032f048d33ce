import os
import sys

# The cluster helpers of the gateway suites.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gateway"))
