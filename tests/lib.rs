//! Nothing here: the tests are `suite/`, a test target of this package.
