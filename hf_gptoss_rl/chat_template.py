"""The harmony chat template of the offline GPT-OSS tokenizer (a Jinja template written for this project).

`load_gptoss_tokenizer()` attaches :data:`HARMONY_CHAT_TEMPLATE`, so `tokenizer.apply_chat_template(...)`, a saved
checkpoint reloaded with `AutoTokenizer` (transformers writes it as `chat_template.jinja`) and
`pipeline("text-generation")` render GPT-OSS conversations as :func:`hf_gptoss_rl.harmony.render_prompt` does, i.e. as
`openai-harmony`'s `HARMONY_GPT_OSS` encoding renders them (its `render_conversation_for_completion`; the tests compare
the token ids). What is rendered follows the renderer in openai/harmony `src/encoding.rs`:

* system message: model identity, `Knowledge cutoff: 2024-06`, `Current date: ...` (only with the template keyword
  `conversation_start_date`), `Reasoning: <reasoning_effort>` (keyword, default `"medium"`), the valid-channels line and,
  when tools are given, the line that sends function calls to the commentary channel;
* developer message (only with instructions or tools): `# Instructions` from the keyword `developer_instructions` and a
  leading `system` / `developer` chat message (joined by a blank line, in that order), and `# Tools` with the
  `functions` namespace, each tool's JSON-schema parameters written as a TypeScript-like type
  (`HarmonyEncoding::json_schema_to_typescript`: objects, optional `?` fields, string enums, arrays, type unions,
  `oneOf`, `nullable`, titles, descriptions, examples and defaults as comments);
* user messages; assistant messages (`thinking` / `reasoning_content` on the analysis channel, `content` on the final
  channel or on `channel` / with `recipient` / `content_type` as given, `tool_calls` as
  `<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>ARGS<|call|>`); tool results
  (`role: "tool"` with the function `name`, else the name of the preceding assistant tool call) as
  `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>`;
* harmony's rule for earlier reasoning (`render_conversation_into`, `auto_drop_analysis`): when the last assistant
  message is on the final channel, analysis messages before the conversation's first final message are dropped;
* `add_generation_prompt=True` appends `<|start|>assistant`; without it, a conversation that ends with a final answer
  ends with `<|return|>` instead of `<|end|>` (harmony's `render_conversation_for_training`), the token the model
  must learn to stop with;
* assistant messages (after `<|start|>assistant`) are wrapped in `{% generation %}` so that
  `return_assistant_tokens_mask=True` (TRL's `assistant_only_loss`) finds them.

Known differences from `openai-harmony`, all outside what the model is trained to see:

* special-token strings inside message text (a user typing `<|end|>`) are encoded by harmony as plain text; a chat
  template's output is tokenized with special tokens recognised, unless `apply_chat_template(...,
  sanitize_control_tokens=True)` (in transformers 5.24) is used, which encodes them as text again;
* a non-string `default` in a tool schema is written with Python's `json.dumps`, harmony with serde_json: floats in
  exponent form (`1e+20` vs `1e20`) differ;
* description lines are split with Python's `str.splitlines` (harmony: Rust's `str::lines`, `\\n` only), which also
  splits on rare separators such as `\\x0b` or `\\u2028`.
"""

from __future__ import annotations

__all__ = ["HARMONY_CHAT_TEMPLATE"]

# Every tag trims the whitespace around it ({%- -%}, {{- -}}): all output, newlines included, comes from expressions.
# Dict keys are read with subscripts (`schema.items` would be the dict's method, not the JSON-schema keyword) and the
# `items` keyword is tested with `in`, since a missing key also falls back to the method.
HARMONY_CHAT_TEMPLATE = r"""
{#- ---------------------------------------------------------------- JSON schema -> TypeScript-like type -#}
{%- macro is_array(value) -%}
    {{- "1" if value is sequence and value is not string and value is not mapping else "" -}}
{%- endmacro -%}
{%- macro is_enum(schema) -%}
    {{- "1" if schema['enum'] is defined and is_array(schema['enum']) and schema['enum'] | length > 0 else "" -}}
{%- endmacro -%}
{%- macro default_text(schema, quote_enum_strings) -%}
    {#- `default: ...`; strings are quoted unless the schema is an enum (then only where `quote_enum_strings`) -#}
    {%- set value = schema['default'] -%}
    {%- if value is string and not is_enum(schema) -%}
        {{- 'default: "' ~ value ~ '"' -}}
    {%- elif value is string and not quote_enum_strings -%}
        {{- 'default: ' ~ value -}}
    {%- else -%}
        {{- 'default: ' ~ value | tojson(separators=(",", ":")) -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro with_null(schema, text) -%}
    {{- text -}}
    {%- if schema['nullable'] is defined and schema['nullable'] is sameas true and "null" not in text -%}
        {{- " | null" -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro variant_line(variant, indent, skip_description, property_description) -%}
    {#- one `oneOf` alternative: ` | TYPE // comments` -#}
    {{- indent ~ " | " ~ with_null(variant, to_typescript(variant, indent ~ "   ")) -}}
    {%- set description = variant['description'] if variant['description'] is defined
        and variant['description'] is string and not skip_description
        and variant['description'] != property_description else "" -%}
    {%- set default = default_text(variant, true) if variant['default'] is defined else "" -%}
    {%- set comments = [description, default] | select | join(" ") -%}
    {%- if comments -%}
        {{- " // " ~ comments -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro to_typescript(schema, indent) -%}
    {%- set one_of = schema['oneOf'] if schema['oneOf'] is defined else none -%}
    {%- set types = schema['type'] if schema['type'] is defined else none -%}
    {%- set union = namespace(names=[]) -%}
    {%- if is_array(types) -%}
        {%- for name in types | select("string") -%}
            {%- set union.names = union.names + ["number" if name == "integer" else name] -%}
        {%- endfor -%}
    {%- endif -%}
    {%- if is_array(one_of) -%}
        {%- for variant in one_of -%}
            {{- "\n" ~ variant_line(variant, indent, false, none) -}}
        {%- endfor -%}
    {%- elif union.names -%}
        {{- union.names | join(" | ") -}}
    {%- elif types == "object" -%}
        {%- if schema['description'] is defined and schema['description'] is string -%}
            {{- indent ~ "// " ~ schema['description'] ~ "\n" -}}
        {%- endif -%}
        {{- "{\n" -}}
        {%- set properties = schema['properties'] if schema['properties'] is defined else none -%}
        {%- set required = schema['required'] if schema['required'] is defined and is_array(schema['required'])
            else [] -%}
        {%- if properties is mapping -%}
            {%- for key, value in properties.items() -%}
                {%- set optional = "" if key in required | select("string") | list else "?" -%}
                {%- set has_one_of = value['oneOf'] is defined -%}
                {%- set description = value['description'] if value['description'] is defined
                    and value['description'] is string else none -%}
                {%- if value['title'] is defined and value['title'] is string -%}
                    {{- indent ~ "// " ~ value['title'] ~ "\n" ~ indent ~ "//\n" -}}
                {%- endif -%}
                {%- if not has_one_of and description is not none -%}
                    {{- indent ~ "// " ~ description ~ "\n" -}}
                {%- endif -%}
                {%- if value['examples'] is defined and is_array(value['examples']) and value['examples'] -%}
                    {{- indent ~ "// Examples:\n" -}}
                    {%- for example in value['examples'] | select("string") -%}
                        {{- indent ~ '// - "' ~ example ~ '"\n' -}}
                    {%- endfor -%}
                {%- endif -%}
                {%- if has_one_of and is_array(value['oneOf']) -%}
                    {#- a property with alternatives: comments above it, one line per alternative -#}
                    {%- set variants = value['oneOf'] -%}
                    {%- set first_description = variants[0]['description'] if variants and variants[0] is mapping
                        and variants[0]['description'] is defined and variants[0]['description'] is string
                        else none -%}
                    {%- set above = description is not none and description != first_description -%}
                    {%- if above -%}
                        {{- indent ~ "// " ~ description ~ "\n" -}}
                    {%- endif -%}
                    {%- if value['default'] is defined -%}
                        {{- indent ~ "// " ~ default_text(value, false) ~ "\n" -}}
                    {%- endif -%}
                    {{- indent ~ key ~ optional ~ ":\n" -}}
                    {%- for variant in variants -%}
                        {{- variant_line(variant, indent, loop.first and above, description) ~ "\n" -}}
                    {%- endfor -%}
                    {{- indent ~ ",\n" -}}
                {%- else -%}
                    {{- indent ~ key ~ optional ~ ": " ~ with_null(value, to_typescript(value, indent ~ "    ")) ~ "," -}}
                    {%- if not has_one_of and value['default'] is defined -%}
                        {{- " // " ~ default_text(value, false) -}}
                    {%- endif -%}
                    {{- "\n" -}}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        {{- indent ~ "}" -}}
    {%- elif types == "string" -%}
        {%- set names = (schema['enum'] if is_enum(schema) else []) | select("string") | list -%}
        {%- if names -%}
            {%- for name in names -%}
                {{- ('"' ~ name ~ '"') ~ ("" if loop.last else " | ") -}}
            {%- endfor -%}
        {%- else -%}
            {{- "string" -}}
        {%- endif -%}
    {%- elif types == "number" or types == "integer" -%}
        {{- "number" -}}
    {%- elif types == "boolean" -%}
        {{- "boolean" -}}
    {%- elif types == "array" -%}
        {%- if "items" in schema -%}  {#- not `schema['items']`: Jinja falls back to the dict's `items` method -#}
            {{- to_typescript(schema['items'], indent) ~ "[]" -}}
        {%- else -%}
            {{- "Array<any>" -}}
        {%- endif -%}
    {%- else -%}
        {{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro recipient_of(name) -%}
    {{- name if "." in name else "functions." ~ name -}}
{%- endmacro -%}
{#- ---------------------------------------------------------------- conversation -#}
{%- if not messages -%}
    {{- raise_exception("the harmony chat template needs at least one message") -}}
{%- endif -%}
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else "medium" -%}
{%- if effort not in ["low", "medium", "high"] -%}
    {{- raise_exception("reasoning_effort must be one of low, medium, high; got " ~ effort) -}}
{%- endif -%}
{%- set instructions = [developer_instructions] if developer_instructions is defined and developer_instructions
    else [] -%}
{%- set chat = messages -%}
{%- if messages[0]['role'] in ["system", "developer"] -%}
    {%- if messages[0]['content'] is defined and messages[0]['content'] -%}
        {%- set instructions = instructions + [messages[0]['content']] -%}
    {%- endif -%}
    {%- set chat = messages[1:] -%}
{%- endif -%}
{#- tools: {"name", "description", "parameters"} or {"type": "function", "function": {...}} -#}
{%- set specs = namespace(items=[], names=[]) -%}
{%- for tool in (tools if tools is defined and tools else []) -%}
    {%- set spec = tool['function'] if tool['type'] is defined and tool['type'] == "function"
        and tool['function'] is defined and tool['function'] is mapping else tool -%}
    {%- if spec['name'] is not defined or spec['name'] is not string or not spec['name'] -%}
        {{- raise_exception("tool spec without a name: " ~ spec | tojson) -}}
    {%- endif -%}
    {%- if spec['name'] in specs.names -%}
        {{- raise_exception("duplicate tool name: " ~ spec['name']) -}}
    {%- endif -%}
    {%- set specs.items = specs.items + [spec] -%}
    {%- set specs.names = specs.names + [spec['name']] -%}
{%- endfor -%}
{#- harmony's analysis dropping: find the first final message and whether the last assistant message is final -#}
{%- set scan = namespace(first_final=-1, last_is_final=false) -%}
{%- for message in chat -%}
    {%- if message['role'] == "assistant" -%}
        {%- set has_content = message['content'] is defined and message['content'] -%}
        {%- set has_recipient = message['recipient'] is defined and message['recipient'] -%}
        {%- set channel = message['channel'] if message['channel'] is defined and message['channel']
            else ("commentary" if has_recipient else "final") -%}
        {%- set has_calls = message['tool_calls'] is defined and message['tool_calls'] -%}
        {%- if has_content and channel == "final" and scan.first_final < 0 -%}
            {%- set scan.first_final = loop.index0 -%}
        {%- endif -%}
        {%- set scan.last_is_final = has_content and channel == "final" and not has_calls -%}
    {%- endif -%}
{%- endfor -%}
{%- set drop_analysis = scan.last_is_final and scan.first_final >= 0 -%}
{#- system -#}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06" -}}
{%- if conversation_start_date is defined and conversation_start_date -%}
    {{- "\nCurrent date: " ~ conversation_start_date -}}
{%- endif -%}
{{- "\n\nReasoning: " ~ effort ~ "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if specs.items -%}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{#- developer -#}
{%- if instructions or specs.items -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}
        {{- "# Instructions\n\n" ~ instructions | join("\n\n") -}}
        {%- if specs.items -%}
            {{- "\n\n" -}}
        {%- endif -%}
    {%- endif -%}
    {%- if specs.items -%}
        {{- "# Tools\n\n## functions\n\nnamespace functions {\n" -}}
        {%- for spec in specs.items -%}
            {%- set description = spec['description'] if spec['description'] is defined
                and spec['description'] is string else "" -%}
            {%- for line in description.splitlines() -%}
                {{- "\n// " ~ line -}}
            {%- endfor -%}
            {%- if spec['parameters'] is defined and spec['parameters'] is not none -%}
                {{- "\ntype " ~ spec['name'] ~ " = (_: " ~ to_typescript(spec['parameters'], "") ~ ") => any;\n" -}}
            {%- else -%}
                {{- "\ntype " ~ spec['name'] ~ " = () => any;\n" -}}
            {%- endif -%}
        {%- endfor -%}
        {{- "\n} // namespace functions" -}}
    {%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}
{#- messages -#}
{%- set state = namespace(last_call="") -%}
{%- for message in chat -%}
    {%- set role = message['role'] -%}
    {%- if role == "user" -%}
        {%- if message['content'] is not defined or message['content'] is not string -%}
            {{- raise_exception("user message " ~ loop.index0 ~ " needs a string content") -}}
        {%- endif -%}
        {{- "<|start|>user<|message|>" ~ message['content'] ~ "<|end|>" -}}
    {%- elif role == "assistant" -%}
        {%- set index = loop.index0 -%}
        {%- set thinking = message['thinking'] if message['thinking'] is defined
            else (message['reasoning_content'] if message['reasoning_content'] is defined else none) -%}
        {%- set content = message['content'] if message['content'] is defined else none -%}
        {%- set recipient = message['recipient'] if message['recipient'] is defined and message['recipient']
            else "" -%}
        {%- set channel = message['channel'] if message['channel'] is defined and message['channel']
            else ("commentary" if recipient else "final") -%}
        {%- set calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls']
            else [] -%}
        {%- if not thinking and not content and not calls -%}
            {{- raise_exception("assistant message " ~ index ~ " has no content, thinking or tool_calls") -}}
        {%- endif -%}
        {%- if thinking and not (drop_analysis and index <= scan.first_final) -%}
            {{- "<|start|>assistant" -}}
            {%- generation -%}
                {{- "<|channel|>analysis<|message|>" ~ thinking ~ "<|end|>" -}}
            {%- endgeneration -%}
        {%- endif -%}
        {%- if content and not (drop_analysis and channel == "analysis" and index < scan.first_final) -%}
            {%- set content_type = " " ~ message['content_type'] if message['content_type'] is defined
                and message['content_type'] else "" -%}
            {#- a final answer that ends the conversation ends with <|return|>, as harmony renders conversations for
                training (`render_conversation_for_training`): the token the model stops with -#}
            {%- set end = "<|return|>" if not add_generation_prompt and loop.last and not calls and channel == "final"
                else ("<|call|>" if recipient else "<|end|>") -%}
            {{- "<|start|>assistant" -}}
            {%- generation -%}
                {{- (" to=" ~ recipient if recipient and recipient != "all" else "") ~ "<|channel|>" ~ channel
                    ~ content_type ~ "<|message|>" ~ content ~ end -}}
            {%- endgeneration -%}
        {%- endif -%}
        {%- for call in calls -%}
            {%- set function = call['function'] if call['function'] is defined else call -%}
            {%- set arguments = function['arguments'] if function['arguments'] is defined else "{}" -%}
            {%- set state.last_call = function['name'] -%}
            {{- "<|start|>assistant" -}}
            {%- generation -%}
                {{- " to=" ~ recipient_of(function['name']) ~ "<|channel|>commentary <|constrain|>json<|message|>"
                    ~ (arguments if arguments is string else arguments | tojson) ~ "<|call|>" -}}
            {%- endgeneration -%}
        {%- endfor -%}
    {%- elif role == "tool" -%}
        {%- set name = message['name'] if message['name'] is defined and message['name'] else state.last_call -%}
        {%- if not name -%}
            {{- raise_exception("tool message " ~ loop.index0 ~ " needs the tool's name (e.g. 'code_interpreter')") -}}
        {%- endif -%}
        {{- "<|start|>" ~ recipient_of(name) ~ " to=assistant<|channel|>commentary<|message|>" ~ message['content']
            ~ "<|end|>" -}}
    {%- elif role in ["system", "developer"] -%}
        {{- raise_exception("a " ~ role ~ " message is only allowed first (message " ~ loop.index0 ~ ")") -}}
    {%- else -%}
        {{- raise_exception("message " ~ loop.index0 ~ " has unknown role " ~ role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|start|>assistant" -}}
{%- endif -%}
"""
