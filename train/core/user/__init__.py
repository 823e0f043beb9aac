"""The user's own code (``model.factory``, ``data.factory``, ``train.loss``): checked by
reading it in the launcher (:mod:`.usersource`, nothing executed) and imported, checked
and called in the workers (:mod:`.usercode`)."""
