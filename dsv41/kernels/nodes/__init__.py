"""Node kinds by subject: each module holds its Torch kernels, their costs and their records
(``RECORDS``) side by side; ``kernels/kinds.KINDS`` indexes them all."""
