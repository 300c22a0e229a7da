pub mod config;
pub mod llava15;
pub mod llava_inputs_processor;
pub mod llava_llm;
pub mod llava_next;
pub mod llava_next_inputs_processor;
mod utils;
