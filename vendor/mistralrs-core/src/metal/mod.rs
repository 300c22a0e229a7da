pub mod gdn;
pub mod ssm;
