"""Training and evaluating the length predictors (the product's runtime predictors live
in ``skymesh.predict``)."""
